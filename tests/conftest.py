"""Shared fixtures: tiny randomly initialised LLaMA (GQA), OPT and GPT-NeoX models, and the real SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter. It must be chosen before triton is first
# imported (``@triton.jit`` decides when it runs, also for triton.language's own helpers), and the transformers
# imports below import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (``-n 2``) each worker keeps to one core: one torch thread, one Inductor compile thread, and
# commands run in a subprocess inherit the same (two workers on two cores, none oversubscribed).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ[name] = "1"
    torch.set_num_threads(1)
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from h2o_compress.config import DEFAULT_MIN_CAPACITY as REAL_DEFAULT_FLOOR
from h2o_compress.persistence.calibration_file import default_calibration_path as REAL_DEFAULT_CALIBRATION_PATH


def tiny_llama(seed: int = 0, kv_heads: int = 2, heads: int = 4, head_dim: int = 32, layers: int = 2):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def tiny_opt(seed: int = 0):
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=2,
        word_embed_proj_dim=64, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    return OPTForCausalLM(config).eval()


def tiny_neox(seed: int = 0):
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        rotary_pct=0.25, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    return GPTNeoXForCausalLM(config).eval()


TINY_MODELS = {"llama": tiny_llama, "opt": tiny_opt, "neox": tiny_neox}


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request):
    """Each tiny architecture in turn."""
    return TINY_MODELS[request.param]()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (converted once, then cached). Integration tests only."""
    from h2o_compress import load_model

    return load_model("smollm2-135m", device="cpu")  # int8 weights: the CPU default since issue 50


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real SmolLM2-135M with fp32 weights (``weights_bits=16``), for what is pinned to them (the calibration
    shipped for its fingerprint). Integration tests only."""
    from h2o_compress import load_model

    return load_model("smollm2-135m", device="cpu", weights_bits=16)


def save_tiny_model_dir(path, chat_template: str | None = None, **llama_kwargs) -> str:
    """Save a tiny LLaMA (``tiny_llama(**llama_kwargs)``) and a word-level tokenizer (``w0`` ... ``w125``,
    ``<unk>``, ``</s>``; with ``chat_template`` if given) to ``path`` as a local Hugging Face directory; returns
    ``str(path)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(126)} | {"<unk>": 126, "</s>": 127}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    tiny_llama(**llama_kwargs).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny LLaMA (head_dim 32, 2 KV heads, 2 layers) + word-level tokenizer as a local model directory."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-dir"))


@pytest.fixture(scope="session")
def four_layer_dir(tmp_path_factory):
    """The same with 4 layers (enough to split a model over devices or offload some layers)."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-4"), layers=4)


SM90_PREAMBLE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
target = GPUTarget("cuda", 90, 32)
def compile(fn, sig, consts):
    sig = dict(sig, **{c: "constexpr" for c in consts})
    triton.compile(ASTSource(fn, signature=sig, constexprs=consts), target=target, options={"num_warps": 4})
"""


def compile_for_sm90(body: str, **env) -> None:
    """Run ``body`` (Python source that calls ``compile(kernel, signature, constexprs)`` for each kernel, then
    prints ``compiled``) in a fresh interpreter without ``TRITON_INTERPRET``: Triton lowers the kernels to sm_90
    machine code with its bundled ptxas, no GPU needed. ``env``: extra environment variables. Fails the test with
    the subprocess's stderr."""
    import subprocess
    import sys
    import textwrap

    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = SM90_PREAMBLE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, cwd=repo,
                            timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests run only where a CUDA GPU is present (``pytest -m cuda`` on a GPU machine);
    ``@pytest.mark.slow`` ones (a benchmark's end-to-end smoke run) only where ``-m`` names them
    (``pytest -m slow``), so the default run keeps within CI's time."""
    slow = "slow" in (config.getoption("markexpr") or "")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_slow = pytest.mark.skip(reason="a benchmark's end-to-end smoke run: pytest -m slow runs it")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


@pytest.fixture
def device() -> str:
    """``cuda`` where a GPU is present, else ``cpu`` (Triton kernels then run under its interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="session")
def no_default_floor():
    """The tests exercise eviction on sequences of tens of tokens, below the default floor of a fractional budget
    (``CompressionConfig.min_capacity``: nothing is evicted from a sequence of at most 128 tokens), so in this
    process a config that does not set ``min_capacity`` gets 0 (the budget alone). The floor's own tests
    (tests/runtime/test_min_capacity.py) set it back, and commands run in a subprocess keep the real default."""
    import h2o_compress.config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h2o_compress.config, "DEFAULT_MIN_CAPACITY", 0)
        yield


@pytest.fixture
def default_floor(monkeypatch):
    """The real default floor of a fractional budget in this test (see :func:`no_default_floor`)."""
    import h2o_compress.config

    monkeypatch.setattr(h2o_compress.config, "DEFAULT_MIN_CAPACITY", REAL_DEFAULT_FLOOR)
    return REAL_DEFAULT_FLOOR


@pytest.fixture(scope="module")
def one_torch_thread():
    """A whole test module on one torch thread (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): tiny
    models gain nothing from more, and two oversubscribed shared cores lose a lot (4 s against 30+)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def fitted_calibrations(tmp_path_factory):
    """Every model a test makes a cache of with ``policy="calibrated"`` or ``key_offsets="calibrated"`` and no
    ``calibration`` finds one: in this process the model's default calibration file lives in a private temporary
    directory, fitted the first time it is looked up (the real fit, `h2o_compress.calibration.fit_eviction`, and the
    mean pre-RoPE keys, `key_statistics_of`, where the model has a fixed RoPE, on random token ids: a tiny model has
    no text to calibrate on). The registry-wide tests (policy contract, CPU kernel, compiled step) run the calibrated
    policy through it; `real_calibration_lookup` restores the real lookup (no file: a one-line error)."""
    import h2o_compress.persistence.calibration_file as calibration_file
    from h2o_compress.calibration import fit_eviction
    from h2o_compress.calibration.key_channels import key_statistics_of
    from h2o_compress.models.identity import model_fingerprint, model_identity

    folder = tmp_path_factory.mktemp("calibration")
    folder.chmod(0o700)

    def fitted_path(model):
        path = folder / f"{model_fingerprint(model)}.safetensors"
        if not path.exists():
            vocab = min(int(model.config.vocab_size), 128)
            generator = torch.Generator().manual_seed(0)
            device = next(model.parameters()).device
            pieces = [torch.randint(0, vocab, (1, 64), generator=generator).to(device) for _ in range(2)]
            weights, details = fit_eviction(model, pieces)
            tensors = {calibration_file.EVICTION_WEIGHTS: weights}
            key_mean, _ = key_statistics_of(model, pieces[1:])  # None for a model without a fixed RoPE
            if key_mean is not None:
                tensors[calibration_file.KEY_CHANNEL_MEAN] = key_mean
            calibration = calibration_file.Calibration(tensors, model_fingerprint(model), model_identity(model),
                                                       details)
            calibration_file.save_calibration(path, calibration)
        return path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration_file, "default_calibration_path", fitted_path)
        yield folder


@pytest.fixture
def real_calibration_lookup(monkeypatch, tmp_path):
    """The real default-calibration lookup (see :func:`fitted_calibrations`), over an empty cache root."""
    import h2o_compress.persistence.calibration_file as calibration_file

    monkeypatch.setenv("H2O_COMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration_file, "default_calibration_path", REAL_DEFAULT_CALIBRATION_PATH)
