"""Transfer engine: moves expert weights between micro-step placements."""
