"""Quality evaluation and profiling: what a compression setting costs and what it saves, measured.

- :func:`text_perplexity` / :func:`streaming_perplexity`: the text is read through the compressed cache chunk by
  chunk (``h2o-compress eval perplexity``).
- :func:`needle_eval`: passkey retrieval per (context length, depth) (``h2o-compress eval needle``).
- :func:`agreement_eval`: greedy generations vs the uncompressed cache, token match and ROUGE-L
  (``h2o-compress eval agreement``).
- :func:`run_profile`: the (policy x budget x bits) sweep with speed and memory, written as JSON, Markdown,
  PNG plots and HTML by :func:`write_report` (``h2o-compress profile``); each configuration as a Ray task with
  ``ray_address=`` (:mod:`.ray_sweep`, ``profile --ray``), and resumed from the rows a previous run of the same
  sweep finished (:mod:`.rows`).
"""

from .agreement import AgreementResult, agreement_eval, prefix_match_rate, rouge_l, token_match_rate
from .corpus import default_corpus, load_prompts
from .needle import NeedleResult, extract_answer, is_correct, needle_eval, plant_needle
from .perplexity import PerplexityResult, reference_perplexity, streaming_perplexity, text_perplexity
from .profile import ProfileSettings, run_profile
from .report import write_report

__all__ = [
    "AgreementResult", "agreement_eval", "prefix_match_rate", "rouge_l", "token_match_rate",
    "default_corpus", "load_prompts",
    "NeedleResult", "extract_answer", "is_correct", "needle_eval", "plant_needle",
    "PerplexityResult", "reference_perplexity", "streaming_perplexity", "text_perplexity",
    "ProfileSettings", "run_profile", "write_report",
]
