"""The acceleration report: schema (what a report holds), measure (how numbers are taken), collector
(the TrainerCallback that fills a report), sinks (JSON, W&B, console), console (tables), cli
(``hf-speedup report``)."""

from .schema import REPORT_FILE, REPORT_VERSION, Metrics, Report, load_report, plan_entries

__all__ = ["REPORT_FILE", "REPORT_VERSION", "Metrics", "Report", "load_report", "plan_entries"]
