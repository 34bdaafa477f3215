"""Code that runs on cluster nodes: probes, the trial runner and the Ray executor."""
