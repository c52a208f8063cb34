"""Model factories for the job files in parameters/ that train a model the workbook did not write."""
