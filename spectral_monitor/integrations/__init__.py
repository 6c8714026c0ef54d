"""Integrations of the monitor with training loops other than Lightning's."""
