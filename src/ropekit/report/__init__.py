"""ropekit.report: plots and Markdown/HTML reports assembled from result JSON."""
