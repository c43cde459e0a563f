"""Celery application, tasks and the node agent: the only place where stages meet."""
