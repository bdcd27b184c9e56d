"""Drivers beyond the DAPO loop, on one supervised loop (`fit`): sft, sft_chat, rm, dpo."""
