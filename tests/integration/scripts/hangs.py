"""Hangs before its first step (the script-trial tests' "hangs")."""
import time

print("waiting for a lock that never comes", flush=True)
time.sleep(3600)
