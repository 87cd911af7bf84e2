"""Bridges to other tools: lm-evaluation-harness (:mod:`.lm_eval_model`, :mod:`.lm_eval_tasks`) and Ray
(:mod:`.ray_sweep`). Their optional dependencies are imported only when used."""
