"""`vaecache report`: one static page about a cache (contents, failures, scale, clips, text), written by
`vaecache.report.build.write_report`. The package imports nothing heavy on its own; matplotlib and Jinja2 (the
`report` extra) load when a report is written."""
