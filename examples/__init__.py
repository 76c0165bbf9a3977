"""Example training programs of the three conventions the chart launches (train.argsConvention)."""
