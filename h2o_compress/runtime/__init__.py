"""Running a model with a compressed cache: :mod:`.generation` (``generate``, ``make_cache``), :mod:`.batch` (``generate_batch``: many prompts, batched), :mod:`.prefill`,
:mod:`.prompt_cache` (saved and resumed prompts), :mod:`.ask` (compress-then-ask), :mod:`.context_scores`
(KVzip / lookahead scoring of a context), :mod:`.compiled` (the compiled decode step) and :mod:`.chat`
(chat templates, bounded)."""
