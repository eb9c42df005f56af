"""The kernels under a mesh: the partitioning rule (``partition``) and the halo exchanges."""
