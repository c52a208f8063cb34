"""The job's schema: its keys and their rules, the YAML reader, the factory rule for user code, the inductor options a
job may give (``compile_options``), paths and overrides. Nothing here measures, trains or writes results."""
