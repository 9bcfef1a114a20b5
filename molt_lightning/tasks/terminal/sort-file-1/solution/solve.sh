#!/bin/bash
sort names.txt > sorted.txt
