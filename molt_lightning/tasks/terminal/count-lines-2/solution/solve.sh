#!/bin/bash
wc -l < list.txt > count.txt
