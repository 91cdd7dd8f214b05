"""Regeneration: a sample's assistant turns made the served model's before their states are
extracted (``step``), and the durable record of each turn (``record``). docs/regeneration.md.
"""
