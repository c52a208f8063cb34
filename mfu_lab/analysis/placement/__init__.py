"""Step 6's cluster side: the placement model, its calibration and checks, the strategies, cluster files and the
scheduler (hints, simulation). Pure functions over data; nothing here runs a rank."""
