"""The one decode loop (``h2o_compress.runtime.decode_loop``) and the one front door: a request checked once."""

from __future__ import annotations

import torch

from h2o_compress.runtime import decode_loop
from h2o_compress.runtime.decode_loop import decode, decode_steps, ended

VOCAB = 8


def _scripted_step(script: list[int], seen: list[tuple[int, int]]):
    """A decode step that ignores the model and answers ``script`` in turn (the argmax of one-hot logits),
    recording each ``(token fed, position)``."""
    turn = iter(script)

    def step(model, token, cache, positions, mask):
        assert mask is None or mask.shape == (token.shape[0], int(positions[0, 0]) + 1)
        seen.append((int(token[0, 0]), int(positions[0, 0])))
        return torch.nn.functional.one_hot(torch.tensor([next(turn)]), VOCAB).float()

    return step


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1, keepdim=True)


def test_decode_feeds_each_token_at_its_position_and_stops_at_an_end_id():
    fed, streamed = [], []
    ids, decode_s, compile_s = decode(_scripted_step([5, 6, 7, 1, 4], fed), None, None, torch.tensor([[3]]), 10,
                                      _argmax, {7}, 50, on_ids=lambda ids: streamed.append(list(ids)))
    assert ids == [3, 5, 6, 7]  # stops after the end id, before its step
    assert fed == [(3, 10), (5, 11), (6, 12)]  # the first token at ``seen``, each next one position later
    assert streamed == [[3], [3, 5], [3, 5, 6], [3, 5, 6, 7]]  # the first token too, then one call per step
    assert decode_s >= 0 and compile_s >= 0


def test_decode_stops_at_max_new_tokens_and_leaves_the_untimed_steps_out(monkeypatch):
    class Clock:  # one second per reading: a step reads it twice
        now = 0.0

        def perf_counter(self):
            Clock.now += 1.0
            return Clock.now

    monkeypatch.setattr(decode_loop, "time", Clock())
    ids, decode_s, compile_s = decode(_scripted_step([1, 2, 3, 4, 5, 6], []), None, None, torch.tensor([[0]]), 0,
                                      _argmax, set(), 4, untimed=1)
    assert ids == [0, 1, 2, 3] and ended(ids, set(), 4)
    assert (compile_s, decode_s) == (1.0, 2.0)


def test_decode_steps_asks_for_inputs_before_each_step_and_stops_when_told():
    rows = {"left": 2}

    def feed():
        return torch.tensor([[1], [2]]), torch.tensor([[4], [9]]), None

    def step(model, token, cache, positions, mask):
        rows["left"] -= 1
        return torch.nn.functional.one_hot(token[:, 0] + positions[:, 0], 16).float()

    done = list(decode_steps(step, None, None, feed, _argmax, lambda: rows["left"] > 0, untimed=1))
    assert [d.values for d in done] == [[5, 11], [5, 11]] and [d.timed for d in done] == [False, True]


def test_the_generate_job_checks_each_setting_once(monkeypatch, tiny_model_dir):
    """``h2o-compress generate``'s path (the job, then the runtime) validates the generation arguments once, as the
    job's `GenerationRequest` when the job is made; the runtime trusts the request (``compile`` is not checked
    again, only whether the cache it made can compile)."""
    from h2o_compress import CompressionConfig
    from h2o_compress.jobs import run_generate
    from h2o_compress.runtime import compiled, generation

    calls = []
    for module, name in ((generation, "check_generation_args"), (generation, "check_compile"),
                         (compiled, "check_compile")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    report = run_generate("w1 w2 w3 w4", tiny_model_dir, CompressionConfig(budget=8, kv_bits=4), max_new_tokens=3,
                          chat=False, compile=False, load={"device": "cpu"})
    assert report.result.new_tokens >= 1
    assert calls.count("check_generation_args") == 1 and calls.count("check_compile") == 1


def test_the_batch_job_checks_each_setting_once(monkeypatch, tiny_model_dir, tmp_path):
    """``h2o-compress batch``'s path (the job, then the batch) validates the job-wide generation arguments once, as
    the job's `GenerationRequest` when the job is made; each request is still checked as it is read."""
    from h2o_compress.jobs import run_batch
    from h2o_compress.runtime import batch, compiled, generation

    calls = []
    for module, name in ((generation, "check_generation_args"), (batch, "check_generation_args"),
                         (generation, "check_compile"), (batch, "check_compile"), (compiled, "check_compile")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "w1 w2 w3"}\n{"id": "b", "prompt": "w4 w5"}\n')
    report = run_batch(str(source), str(tmp_path / "out.jsonl"), tiny_model_dir, max_new_tokens=3, chat=False,
                       compile=False, batch_size=2, load={"device": "cpu"})
    assert report.stats.prompts == 2 and report.stats.errors == 0
    assert calls.count("check_generation_args") == 1 and calls.count("check_compile") == 1
