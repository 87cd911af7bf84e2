"""The profile sweep: policies x budgets x KV bits, measured for KV bytes, peak memory, speed and quality
(`h2o_compress.profiling.sweep`), each configuration a row file that a later run reuses (`h2o_compress.profiling.rows`), written as JSON, Markdown,
PNG plots and HTML (`h2o_compress.profiling.report`). ``h2o-compress profile``."""

from h2o_compress.profiling.report import write_report
from h2o_compress.profiling.sweep import ProfileSettings, run_profile

__all__ = ["ProfileSettings", "run_profile", "write_report"]
