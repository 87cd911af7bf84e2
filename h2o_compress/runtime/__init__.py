"""Running a model with a compressed cache: [`h2o_compress.runtime.generation`][h2o_compress.runtime.generation] (``generate``, ``make_cache``), [`h2o_compress.runtime.batch`][h2o_compress.runtime.batch] (``generate_batch``: many prompts, batched), `h2o_compress.runtime.prefill`,
`h2o_compress.runtime.prompt_cache` (saved and resumed prompts), [`h2o_compress.runtime.ask`][h2o_compress.runtime.ask] (compress-then-ask), `h2o_compress.runtime.context_scores`
(KVzip / lookahead scoring of a context), `h2o_compress.runtime.compiled` (the compiled decode step), `h2o_compress.runtime.decode_loop`
(the one decode loop that ``generate``, ``generate_batch`` and the evaluations' greedy continuation run) and `h2o_compress.runtime.chat`
(chat templates, bounded)."""
