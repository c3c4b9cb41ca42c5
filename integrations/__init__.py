"""Adapters that make existing trainers use the fsdp2_strategy core."""
