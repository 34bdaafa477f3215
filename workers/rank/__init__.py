"""What runs inside a rank: the trial runner, the probe's rank, the model and its
parallelisms (torch). Never imports ``workers.host``."""
