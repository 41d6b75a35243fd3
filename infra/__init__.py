"""trajbus.infra"""
