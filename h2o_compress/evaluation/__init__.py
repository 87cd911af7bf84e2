"""Quality evaluation: what a compression setting costs, measured against the uncompressed cache.

- [`text_perplexity`][h2o_compress.evaluation.text_perplexity] / [`streaming_perplexity`][h2o_compress.evaluation.streaming_perplexity]: the text is read through the compressed cache chunk by
  chunk (``h2o-compress eval perplexity``).
- [`needle_eval`][h2o_compress.evaluation.needle_eval]: passkey retrieval per (context length, depth) (``h2o-compress eval needle``).
- [`agreement_eval`][h2o_compress.evaluation.agreement_eval]: greedy generations vs the uncompressed cache, token match and ROUGE-L
  (``h2o-compress eval agreement``).
- [`reporting_text`][h2o_compress.evaluation.reporting_text]: the reporting corpus (`REPORTING_TEXTS`), texts quality figures are reported on and
  nothing is tuned on (the tuning text is `TUNING_TEXT`, the default corpus).
(The profile sweep over many settings is [`h2o_compress.profiling`][h2o_compress.profiling].)
"""

from h2o_compress.evaluation.agreement import AgreementResult, agreement_eval, prefix_match_rate, rouge_l, token_match_rate
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, TUNING_TEXT, default_corpus, load_prompts, reporting_text
from h2o_compress.evaluation.needle import NeedleResult, extract_answer, is_correct, needle_eval, plant_needle
from h2o_compress.evaluation.perplexity import PerplexityResult, reference_perplexity, streaming_perplexity, text_perplexity

__all__ = [
    "AgreementResult", "agreement_eval", "prefix_match_rate", "rouge_l", "token_match_rate",
    "REPORTING_TEXTS", "TUNING_TEXT", "default_corpus", "load_prompts", "reporting_text",
    "NeedleResult", "extract_answer", "is_correct", "needle_eval", "plant_needle",
    "PerplexityResult", "reference_perplexity", "streaming_perplexity", "text_perplexity",
]
