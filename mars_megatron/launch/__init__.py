"""Scale-out: sizing a layout for a cluster (:mod:`.planner`) and launching runs on it (local or Slurm,
through NeMo-Run: :mod:`.nemo`)."""
