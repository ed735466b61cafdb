"""A Tinker-compatible training service (``job.recipe = "service"``): the official ``tinker`` SDK
drives the engine over HTTP. ``operations`` is what the HTTP layer hands the dispatch layer."""
