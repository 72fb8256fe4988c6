"""`eyas doctor`: static, target-aware and dynamic contract checks of a drafter checkpoint.

findings.py (ids, severities, the report), reading.py (what each engine would load),
static.py (checkpoint alone), with_target.py (sizes, embedding, aux ids, engine support
tables), dynamic.py (step-0 accuracy and acceptance per engine reading, cause location,
vocabulary comparison, flag recommendations).
"""
