"""The contracts every layer may import and nothing below them: the data a task hands the runtime and a
batch the trainer trains on (batch.py), the one log-prob function (ops.py), micro-batches
(micro.py), the trainer's hook an algorithm implements (algorithm.py), typed configs and their
ranges (config.py, config_check.py), a user's mistake as one line (errors.py), metrics, plots and
progress bars (log.py, plots.py, progress.py) and what the project wrote in a run folder
(run_files.py). They import nothing of the project but each other; tba/ and areal/ see only these."""
