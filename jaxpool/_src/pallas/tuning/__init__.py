"""Launch tuning: the tuner, its disk cache and shipped tables, and the trials' inputs."""
