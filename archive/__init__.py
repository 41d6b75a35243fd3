"""trajbus.archive"""
