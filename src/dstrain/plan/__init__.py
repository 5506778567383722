"""What a layout costs: enumeration, time model, bytes per collective, calibration, pipeline-bubble simulation.
Only the commands import it; training never does."""
