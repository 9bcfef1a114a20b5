#!/bin/bash
wc -l < log.txt > count.txt
