"""What the rows and experiments share (the service harness, camera streams, the table's row format, small helpers)
and the report tools (tables, profile summaries, the mutation report)."""
