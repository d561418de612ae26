"""What a user runs around training: the memory planner, eval, compare, report, chat, export, the demo,
the config reference. May import every layer."""
