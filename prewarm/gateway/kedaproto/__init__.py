"""Python modules generated from KEDA's externalscaler.proto (`make proto` regenerates them)."""
