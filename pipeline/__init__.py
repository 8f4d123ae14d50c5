"""Stage graph, coordinator, runtime, streams, trace, engine."""
