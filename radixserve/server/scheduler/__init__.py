"""The scheduler process (and the data-parallel controller, tensor-parallel ranks, PD glue)."""
