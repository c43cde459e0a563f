"""The node agent: a Celery worker per GPU node that brings replicas up, keeps them warm and retires them."""
