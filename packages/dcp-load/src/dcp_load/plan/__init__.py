"""The plan layer: what each rank wants, who reads each byte, derived planning without gathering, the checkpoint digest and plan simulation. Imports only `layouts` and below."""

__all__: list[str] = []
