"""trajbus.schemas"""
