"""A batch job on a Ray cluster with Ray Data (``h2o-compress batch --ray [ADDRESS]``; Ray Data's ``map_batches``
with a class: https://docs.ray.io/en/latest/data/transforming-data.html).

- The prompts become a dataset of JSON rows; ``map_batches`` runs `BatchActor` on them: one actor per GPU of
  the cluster, or per ``threads`` CPUs where it has none, each loading the model once and answering its share
  through [`h2o_compress.generate_batch`][h2o_compress.generate_batch] (continuous batching, ``batch_size`` rows).
- This process (the driver) writes each answer as it comes back, so OUTPUT has the same semantics as a local run
  (each prompt once, appended and flushed, resumable): the caller hands `run_on_ray` only the prompts not
  answered yet and writes what it yields.
- ``address`` and the shipping of this package to the workers are those of ``profile --ray``
  (`h2o_compress.integrations.ray_sweep`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from h2o_compress.config import CompressionConfig
from h2o_compress.integrations.ray_sweep import check_address, connect, import_ray
from h2o_compress.models import load_model
from h2o_compress.runtime.batch import generate_batch
from h2o_compress.runtime.batch_requests import BatchResult
from h2o_compress.utils.errors import ConfigError, short

#: Prompts handed to one actor call, in units of the batch size: enough for its rows to refill while the call runs.
CALL_BATCHES = 4


class BatchActor:
    """A Ray Data actor: loads the model once (``load_model(model, **load)``), then answers each batch of rows
    (column ``request``: a request as JSON) with [`generate_batch`][h2o_compress.runtime.batch.generate_batch]; returns the
    column ``result`` (each answer's line as JSON)."""

    def __init__(self, model: str, load: dict, config: CompressionConfig, generation: dict, threads: int | None,
                 trust_remote_code: bool):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model, self.tokenizer = load_model(model, trust_remote_code=trust_remote_code, **load)
        self.config, self.generation = config, generation

    def __call__(self, batch: dict) -> dict:
        requests = [json.loads(text) for text in batch["request"]]
        results = sorted(generate_batch(self.model, self.tokenizer, requests, self.config, **self.generation),
                         key=lambda r: r.index)
        return {"result": [json.dumps(r.to_dict()) for r in results]}


def run_on_ray(address: str, requests: list[dict], model: str, config: CompressionConfig, generation: dict,
               load: dict | None = None, threads: int | None = None, trust_remote_code: bool = False,
               device: str = "auto") -> Iterator[BatchResult]:
    """Answer ``requests`` (dicts with an ``id``) on the Ray cluster at ``address``; yields each answer as it
    comes back (in no set order). ``generation``: the keyword arguments of ``generate_batch`` (``max_new_tokens``,
    ``batch_size``, ``chat``, ``temperature``, ``seed``, ``compile``).

    Raises:
        ConfigError: Ray (with Ray Data) not installed, an empty address, or a cluster that cannot be reached.
    """
    ray = import_ray()
    address = check_address(address)
    try:
        import ray.data  # noqa: F401 (Ray Data needs pyarrow: the ray extra installs it)
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Data ({short(str(exc), 80, repr_=False)}); allowed: install the ray "
                          "extra (pip install 'h2o-compress[ray]')") from None
    connected_here = connect(ray, address)
    try:
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        per_actor = {"num_gpus": 1} if gpus and not device.startswith("cpu") else {"num_cpus": threads or 1}
        actors = gpus if "num_gpus" in per_actor else max(1, cpus // (threads or 1))
        actors = max(1, min(actors, -(-len(requests) // generation.get("batch_size", 8))))
        rows = ray.data.from_items([{"request": json.dumps(r)} for r in requests])
        answers = rows.map_batches(
            BatchActor, batch_size=CALL_BATCHES * generation.get("batch_size", 8), concurrency=actors,
            fn_constructor_kwargs={"model": model, "load": load or {}, "config": config, "generation": generation,
                                   "threads": threads, "trust_remote_code": trust_remote_code},
            **per_actor)
        for row in answers.iter_rows():
            line = json.loads(row["result"])
            yield BatchResult(id=line["id"], index=-1, text=line["text"], prompt_tokens=line["prompt_tokens"],
                              new_tokens=line["new_tokens"], finish_reason=line["finish_reason"],
                              error=line.get("error"))
    finally:
        if connected_here:
            ray.shutdown()
