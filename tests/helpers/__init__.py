"""Helpers shared by test files in several folders (imported as ``helpers.<module>``; ``tests/`` is on ``sys.path``
because pytest puts the folder of the root ``tests/conftest.py`` there). Fixtures and the tiny models stay in
``tests/conftest.py``.

- :mod:`helpers.architectures`: a tiny random model of every decoder-only class transformers ships.
- :mod:`helpers.decode_steps`: the prefill + greedy decode drill of the compile, kernel and head-budget tests.
- :mod:`helpers.measured_caches`: a cache after ``generate``'s steps and the planner's figure for it.
- :mod:`helpers.strategies`: hypothesis settings and strategies of the property tests.
- :mod:`helpers.tiny_lm`: the tiny LLaMA with an English BPE tokenizer (evaluation, profiling, ask tests).
"""
