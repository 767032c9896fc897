"""Lightning callbacks: schedule, select modules, call probes and functional, log, alert, act."""
