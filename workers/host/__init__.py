"""What launches and watches ranks: the transports (Ray, local), the monitor, the kinds of
trial, the probe, the tuner's runner. No torch at import time; never imports ``workers.rank``
at module level."""
