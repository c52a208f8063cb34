"""The tables of the step reports and the index, one module per step (and the layout's): results in,
rows out for the Jinja2 templates. No drawing, no file writes."""
