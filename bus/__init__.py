"""trajbus.bus"""
