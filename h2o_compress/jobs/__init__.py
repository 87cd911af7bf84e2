"""What the commands that run a model do, one Python call each (the CLI parses options, calls it and prints):

- `h2o_compress.jobs.generate`: [`run_generate`][h2o_compress.jobs.run_generate] / [`GenerateJob`][h2o_compress.jobs.GenerateJob] (``h2o-compress generate``: the planner under a
  memory limit, prompt caches, the summary figures);
- `h2o_compress.jobs.batch`: [`run_batch`][h2o_compress.jobs.run_batch] / [`BatchJob`][h2o_compress.jobs.BatchJob] (``h2o-compress batch``: a file of prompts, answers appended
  as they finish, resumable, the batch sized by the planner);
- `h2o_compress.jobs.ask`: [`run_ask`][h2o_compress.jobs.run_ask] / [`AskJob`][h2o_compress.jobs.AskJob] (``h2o-compress ask``: compress a document once, then answer).

Each job checks every setting when it is made, before anything is loaded or written. ``profile`` runs
[`h2o_compress.profiling.run_profile`][h2o_compress.profiling.run_profile], ``plan`` [`h2o_compress.planner.plan`][h2o_compress.plan] and ``eval`` the functions of
[`h2o_compress.evaluation`][h2o_compress.evaluation]. This layer sits above the planner (``generate --memory-limit`` uses it) and below
the CLI.
"""

from h2o_compress.jobs.ask import AskJob, AskReport, AskSession, run_ask
from h2o_compress.jobs.batch import BatchJob, BatchReport, run_batch
from h2o_compress.jobs.generate import GenerateJob, GenerateReport, run_generate

__all__ = ["AskJob", "AskReport", "AskSession", "BatchJob", "BatchReport", "run_batch", "GenerateJob", "GenerateReport", "run_ask", "run_generate"]
