"""Process control: child processes that never outlive the run, faults turned into errors, the run's budget,
progress lines and the notebook libraries' quick import. Knows no step and no result format."""
