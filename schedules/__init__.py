"""YAML stage schedules (data, not code); see pipeline/schedule.py for the format."""
