"""Bridges to other tools: lm-evaluation-harness (`h2o_compress.integrations.lm_eval_model`, `h2o_compress.integrations.lm_eval_tasks`) and Ray
(`h2o_compress.integrations.ray_sweep`). Their optional dependencies are imported only when used."""
