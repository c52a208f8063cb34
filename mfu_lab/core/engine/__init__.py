"""The training engine: the workload (model, loss, step), the data and its batches, the layout and its application.
Nothing here times, stores or presents: measurement lives in core.measure, files in core.store."""
