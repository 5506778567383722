"""What a layout costs: the memory model behind ``dstrain estimate`` (memory, memory_parts, activations,
averaging_memory, param_counts, pipe_schedules), enumeration, time model, bytes per collective, calibration,
pipeline-bubble simulation. Only the commands import it; training never does."""
