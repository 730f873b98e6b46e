"""The performance rows: each script measures one or more results that ``benchmarks.run_all`` runs and shows in
docs/performance.md's table, and formats its own rows of that table (``table_rows``: a result's JSON to rows)."""
