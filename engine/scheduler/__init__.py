"""The scheduler process: runs from schedules, backfills, and housekeeping."""
